"""Which engines are up: a health check of every engine at start and then every
``RouterArgs.health_interval`` seconds, in a thread of its own (the event loop never waits on it).

A check is ``GET /health`` (open on the engines); a 200 marks the engine up, anything else
(no connection, a timeout, a 503) down. An engine that passes its first check, or passes one
after being down, is (re)connected: its ``/kv_cache_info`` is read with the engine key and, if
the router follows its events, its subscription starts over (it may have restarted:
:meth:`Replica.connect`). An engine that refuses the engine key stays down with that reason.

At start (:meth:`HealthMonitor.wait_until_serving`) the router waits, up to
``startup_timeout``, for at least one engine it can answer with (a replica; in disaggregated
mode a decode engine), logging what it waits for; engines still loading then join as they
come up. The forwarding marks an engine down as soon as a connection to it fails.

The checking thread runs in :attr:`HealthMonitor.background` (``router-health``): a round that
fails (an engine that answers something no check foresaw) is counted and logged there and the
next round runs; should the thread die anyway, the router's ``/health`` says degraded, naming it
(``/health`` itself still checks every engine when asked).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import httpx

from pagedkv.background import BackgroundThreads
from pagedkv.errors import ConfigError
from pagedkv.router.config import RouterArgs
from pagedkv.router.replica import Replica

__all__ = ["THREAD_NAME", "HealthMonitor"]

logger = logging.getLogger(__name__)

THREAD_NAME = "router-health"

_PROBE_TIMEOUT_S = 5.0


class HealthMonitor:
    """Health checks of ``engines``; :meth:`start` runs them periodically until :meth:`close`."""

    def __init__(self, engines: Sequence[Replica], args: RouterArgs) -> None:
        self.engines = list(engines)
        self.args = args
        self._client = httpx.Client(timeout=_PROBE_TIMEOUT_S)
        self._lock = threading.Lock()  # one round at a time (the thread, /health, the start)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.background = BackgroundThreads()
        self._warn_without_events = sum(e.follow_events for e in self.engines) > 1

    def check_all(self) -> None:
        """One health check of every engine, now."""
        with self._lock:
            for engine in self.engines:
                self._check(engine)

    def _check(self, engine: Replica) -> None:
        try:
            answer = self._client.get(engine.url + "/health")
            if answer.status_code != 200:
                engine.mark_down(f"/health answered {answer.status_code}")
                return
            if engine.up and engine.connected:
                return
            info = self._client.get(engine.url + "/kv_cache_info", headers=self.args.engine_headers())
        except httpx.HTTPError as exc:
            engine.mark_down(f"did not answer /health ({type(exc).__name__}: {exc})")
            return
        if info.status_code in (401, 403):
            logger.error("engine %s refused the router's engine key: give it with --engine-api-key", engine.url)
            engine.mark_down(f"/kv_cache_info answered {info.status_code}: the engine key was refused")
            return
        if info.status_code != 200:
            engine.mark_down(f"/kv_cache_info answered {info.status_code}")
            return
        try:
            engine.connect(info.json(), warn_without_events=self._warn_without_events)
        except (ValueError, KeyError, TypeError) as exc:
            engine.mark_down(f"/kv_cache_info answered something else than expected ({exc})")
            return
        engine.mark_up()

    def wait_until_serving(self, serving: Sequence[Replica]) -> None:
        """Check every engine until one of ``serving`` is up; ConfigError after the startup timeout."""
        timeout = self.args.startup_timeout
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            self.check_all()
            if any(e.up for e in serving):
                break
            if time.monotonic() >= deadline:
                errors = "; ".join(f"{e.url} {e.last_error}" for e in serving)
                raise ConfigError(f"no engine came up within {timeout:g} s: {errors}")
            if not waited:
                logger.info(
                    "waiting up to %g s for the engines to come up: %s", timeout, ", ".join(e.url for e in serving)
                )
                waited = True
            time.sleep(min(0.5, self.args.health_interval))
        down = [e.url for e in self.engines if not e.up]
        if down:
            logger.warning("starting without %s: each joins when it passes a health check", ", ".join(down))

    def start(self) -> None:
        """Checks every engine every ``health_interval`` seconds, on a thread, until :meth:`close`."""
        self._thread = self.background.start(THREAD_NAME, self._run)

    def _run(self) -> None:
        while not self._stop.wait(self.args.health_interval):
            try:
                self.check_all()
            except Exception as exc:  # noqa: BLE001 - the checks must go on whatever one engine does
                self.background.record_error(THREAD_NAME, exc, "a health check round")

    def close(self) -> None:
        """Stops the checking thread (its end is not a failure) and closes its client."""
        self.background.stopping(THREAD_NAME)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_PROBE_TIMEOUT_S * 2)
        self._client.close()
