"""The background threads a server depends on, and whether each one is still doing its job.

A pagedkv server has threads besides the one that steps the engine: the KV-transfer pull thread
(consumer), the control service (producer), the grammar-compile workers, the KV event
publisher. Each one handles input that comes, in the end, from a client or a peer; if one of
them died of an input it could not handle, every request that needs it would hang while the
server still said it was healthy.

:class:`BackgroundThreads` is where they answer for themselves:

- :meth:`BackgroundThreads.start` runs a thread's loop and records how it ended: a loop that
  returns before :meth:`stop` was asked, or raises, leaves the thread **dead**;
- :meth:`BackgroundThreads.record_error` is what a loop calls for an input it survived (a
  malformed message, a failed pull): the error is counted and logged (at most once every
  ``LOG_EVERY_S`` seconds per thread, so a flood of bad packets cannot flood the log), and the
  loop goes on to its next input;
- :meth:`BackgroundThreads.health` is the server's ``/health``: ``degraded`` (503) while a
  thread that requests need is dead, with each thread's state and error count.

The rule every loop here follows: **one input's failure is that input's answer, never the
loop's end.** A loop wraps each input's handling, not itself, in ``except Exception`` and
reports it; only ``BaseException`` that is not an ``Exception`` (interpreter shutdown) ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BackgroundThreads", "ThreadHealth"]

logger = logging.getLogger(__name__)

# A thread logs at most one survived error per this many seconds (the count covers them all).
LOG_EVERY_S = 10.0
# The text of an error kept for /health (an exception's message can quote an attacker's input).
_MAX_ERROR_CHARS = 300


@dataclass
class ThreadHealth:
    """One registered thread: whether it runs, and the errors it survived (or died of)."""

    name: str
    required: bool
    thread: threading.Thread | None = None
    errors: int = 0
    last_error: str | None = None
    died_of: str | None = None
    stopping: bool = False
    last_logged: float = field(default=-LOG_EVERY_S)

    @property
    def alive(self) -> bool:
        """Running, or never started as a thread (a pool that records errors only), or asked to
        stop."""
        if self.stopping:
            return True
        if self.died_of is not None:
            return False
        return self.thread is None or self.thread.is_alive()

    def as_dict(self) -> dict[str, Any]:
        return {
            "alive": self.alive,
            "required": self.required,
            "errors": self.errors,
            "last_error": self.last_error,
            "died_of": self.died_of,
        }


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + " ..."


class BackgroundThreads:
    """The background threads of one engine or server (see the module docs). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, ThreadHealth] = {}

    def register(self, name: str, *, required: bool = True) -> ThreadHealth:
        """A thread (or pool) that records its errors here without being started here; its
        ``thread`` may be set later. ``required``: requests need it, so its death is
        ``degraded``."""
        with self._lock:
            entry = self._threads.get(name)
            if entry is None:
                entry = self._threads[name] = ThreadHealth(name=name, required=required)
            return entry

    def start(self, name: str, loop: Callable[[], None], *, required: bool = True) -> threading.Thread:
        """Runs ``loop`` on a daemon thread called ``name``. The thread is dead, for
        :meth:`health`, if ``loop`` raises, or returns before :meth:`stopping` was called."""
        entry = self.register(name, required=required)

        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # noqa: BLE001 - recorded: /health says the thread is gone
                entry.died_of = _describe(exc)
                logger.error("background thread %s died: %s", name, entry.died_of, exc_info=True)
                return
            if not entry.stopping:
                entry.died_of = "its loop returned"
                logger.error("background thread %s ended without being stopped", name)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            entry.thread = thread
            entry.died_of = None
            entry.stopping = False
        thread.start()
        return thread

    def adopt(self, name: str, thread: threading.Thread, *, required: bool = True) -> ThreadHealth:
        """Registers ``thread``, started elsewhere (its owner needs to start it itself, e.g.
        to bind sockets first), under ``name``: dead, for :meth:`health`, once it is no longer
        alive unless :meth:`stopping` was called."""
        entry = self.register(name, required=required)
        with self._lock:
            entry.thread = thread
            entry.required = required
            entry.stopping = False
        return entry

    def died(self, name: str, exc: BaseException) -> None:
        """``name`` is ending because of ``exc`` (an adopted thread's own last words): shown
        as what it died of, logged."""
        entry = self.register(name)
        with self._lock:
            entry.died_of = _describe(exc)
        logger.error("background thread %s died: %s", name, entry.died_of, exc_info=exc)

    def stopping(self, name: str) -> None:
        """``name`` is being stopped on purpose: its end is not a failure."""
        with self._lock:
            entry = self._threads.get(name)
            if entry is not None:
                entry.stopping = True

    def record_error(self, name: str, exc: BaseException, what: str = "an input") -> None:
        """``name`` survived ``exc`` while handling ``what``: counted, logged (rate-limited)."""
        entry = self.register(name)
        now = time.monotonic()
        with self._lock:
            entry.errors += 1
            entry.last_error = _describe(exc)
            log = now - entry.last_logged >= LOG_EVERY_S
            if log:
                entry.last_logged = now
        if log:
            logger.warning(
                "background thread %s: %s failed and was skipped (%d so far): %s",
                name,
                what,
                entry.errors,
                entry.last_error,
                exc_info=exc,
            )

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "threads": {name: {alive, required, errors,
        last_error, died_of}}}``; ``degraded`` while a required thread is dead."""
        with self._lock:
            threads = {name: entry.as_dict() for name, entry in self._threads.items()}
        dead = [name for name, t in threads.items() if t["required"] and not t["alive"]]
        return {"status": "degraded" if dead else "ok", "dead": dead, "threads": threads}

    def error_counts(self) -> dict[str, int]:
        """Errors survived per thread (the ``pagedkv:background_errors`` metric)."""
        with self._lock:
            return {name: entry.errors for name, entry in self._threads.items()}
